"""One context, many questions: load a model (`models`), lay out the prompt (`prompt`), prefill in chunks
(`prefill`), answer on top of the prefilled cache and restore it (`session`), with the records a session returns
(`records`), the text in and out (`text`) and the token budgets of a question and its answer (`limits`)."""
