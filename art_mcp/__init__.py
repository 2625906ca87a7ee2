"""art_mcp: not yet implemented (see the open issues)."""
