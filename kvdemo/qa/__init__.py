"""One context, many questions: load a model (`models`, and those from the package index: `packaged`), lay out
the prompt (`prompt`), refuse what a config hides before the prefill (`probe`), prefill in chunks (`prefill`), decode
and score on top of the prefilled cache (`decode`), answer and restore it (`session`), with the records a session
returns (`records`), the text in and out (`text`), the token budgets of a question and its answer (`limits`), a long
job's bookkeeping over sessions (`job`), and a prefilled session saved to a file and opened again (`session_file`)."""
