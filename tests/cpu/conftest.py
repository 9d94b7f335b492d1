import os
import sys

# Test helpers in this folder (stand-ins, references) import by bare module name.
sys.path.insert(0, os.path.dirname(__file__))
