"""What a quantized cache does to the model, measured against full precision: answer metrics (`metrics`), the
shipped SQuAD cases (`cases`), the next-token statistics and perplexity (`fidelity`), where the KV error sits
(`cache_error`), why a rotation helps (`channel_spread`), and a per-layer plan for a byte budget (`planner`, over what a
plan may be and cost: `plan_budget`)."""
