"""Demo model: a random-weight Llama checkpoint and a tokenizer trained offline, for tests and benchmarks."""

from modelfleet.dataplane.demo.model import SIZES, create_demo_model
from modelfleet.dataplane.demo.tokenizer import train_tokenizer

__all__ = ["SIZES", "create_demo_model", "train_tokenizer"]
