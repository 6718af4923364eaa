"""Alerts while a run is going: rules over per-step statistics, and actions (docs/alerts.md)."""
from gradscope.alerts.engine import Alert, AlertEngine
from gradscope.alerts.monitor import Monitor, check_selectors
from gradscope.alerts.rules import DEFAULT_RULES, Rule, load_rules, parse_rule
from gradscope.alerts.values import StepValues

__all__ = ["DEFAULT_RULES", "Alert", "AlertEngine", "Monitor", "Rule", "StepValues", "check_selectors",
           "load_rules", "parse_rule"]
