"""The OpenAI API without its transport: the front end (front.py), request bodies (protocol.py), responses, tokenize, chat templates, tool calls and structured outputs."""
