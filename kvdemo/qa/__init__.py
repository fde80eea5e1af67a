"""One context, many questions: load a model (`models`), lay out the prompt (`prompt`), prefill in chunks
(`prefill`), answer on top of the prefilled cache and restore it (`session`), with the records a session returns
(`records`), the text in and out (`text`), the token budgets of a question and its answer (`limits`), and a prefilled
session saved to a file and opened again (`session_file`)."""
