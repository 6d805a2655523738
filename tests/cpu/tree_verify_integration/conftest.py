import os
import sys

# _setup.py is imported by plain name.
sys.path.insert(0, os.path.dirname(__file__))
