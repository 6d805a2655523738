import os
import sys

# The helpers in this folder (_interp.py) are imported by plain name.
sys.path.insert(0, os.path.dirname(__file__))
