"""What a quantized cache does to the model, measured against full precision: answer metrics (`metrics`), the
shipped SQuAD cases (`cases`), the next-token statistics and perplexity (`fidelity`) and where the KV error
sits (`cache_error`)."""
