"""The job's data: the prompt stream from the built-in tasks or local files (sources.py), one
record (example.py), the string-reversal task (task.py) and the word problems (arith_words.py),
the character tokenizer and a model directory's tokenizer (tokenizers.py, char_tokenizer_hf.py),
demonstration conversations (demonstrations.py), chat templates and the prompt-length policy
(chat.py), and engine batches from token lists (batch.py).
"""
