"""Entrypoints: the WebSocket listener and sessions, the HTTP API, the command line. They import
the core and the request classes; nothing imports them back."""
