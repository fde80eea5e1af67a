"""What a quantized cache does to the model, measured against full precision: answer metrics (`metrics`), the
shipped SQuAD cases (`cases`), the next-token statistics and perplexity (`fidelity`) and where the KV error
sits (`cache_error`)."""

from kvdemo.evals.cache_error import KV, context_error, kv_error, reference_kv
from kvdemo.evals.cases import Case, example_path, load_case
from kvdemo.evals.fidelity import kl_statistics, perplexity, perplexity_inputs

__all__ = [
    "Case",
    "KV",
    "context_error",
    "example_path",
    "kl_statistics",
    "kv_error",
    "load_case",
    "perplexity",
    "perplexity_inputs",
    "reference_kv",
]
