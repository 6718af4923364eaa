"""gradscope."""
