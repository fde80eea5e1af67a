"""One context, many questions: load a model (`models`), lay out the prompt (`prompt`), prefill in chunks
(`prefill`), answer on top of the prefilled cache and restore it (`session`), with the records a session
returns (`records`) and the text in and out (`text`)."""

from kvdemo.qa.models import LoadedModel, load_model
from kvdemo.qa.prefill import PREFILL_CHUNK_TOKENS, PrefillStopped
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.session import QASession

__all__ = [
    "Answer",
    "LoadedModel",
    "PREFILL_CHUNK_TOKENS",
    "PrefillReport",
    "PrefillStopped",
    "QASession",
    "load_model",
]
