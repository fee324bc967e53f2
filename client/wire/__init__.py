"""The wire protocol client and server share: messages, codec, array encodings, error and close codes."""
