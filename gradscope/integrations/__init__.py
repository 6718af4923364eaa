"""Adapters for other trainers (TRL, verl, ...). Each lives in its own module and imports its optional
dependency only there: ``import gradscope.integrations`` never needs one."""
