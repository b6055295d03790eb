"""The engine: model runner, LLMEngine (add_request / step / abort), offline LLM, async wrapper."""
