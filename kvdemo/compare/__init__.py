"""The same context and questions over several specs, side by side: the run (`run.compare`), one spec
measured (`measure`), and what a comparison returns (`records`)."""

from kvdemo.compare.records import ComparisonReport, QuestionResult, SpecResult
from kvdemo.compare.run import compare

__all__ = [
    "ComparisonReport",
    "QuestionResult",
    "SpecResult",
    "compare",
]
