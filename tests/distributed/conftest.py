import os
import sys

# Shared launcher helpers in this folder import by bare module name.
sys.path.insert(0, os.path.dirname(__file__))
