"""OpenAI's protocol: request bodies, responses and SSE, parameter translation, errors, chat messages, tool calls."""
