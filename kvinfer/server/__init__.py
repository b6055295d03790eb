"""The OpenAI-compatible HTTP server: `create_app` over an AsyncLLMEngine, `kvinfer serve`."""
