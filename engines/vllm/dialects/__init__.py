"""vLLM's agentic API dialects (Anthropic Messages, OpenAI Responses) as the chat request it renders
for each: shared by the gateway (exact token ids for routing) and the emulated engine (serving)."""
