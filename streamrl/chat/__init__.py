"""Chat as models read and write it: messages in OpenAI's shape rendered by a chat template, and
a reply's text parsed back into tool calls."""
