"""The command line: what every tool shares (common), multi-process start-up (distributed), the chat CLI."""
