"""art_langgraph: not yet implemented (see the open issues)."""
