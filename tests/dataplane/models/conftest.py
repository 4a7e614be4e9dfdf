import sys
from pathlib import Path

# Lets the tests here import the checkpoint factory (checkpoints.py) as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
