"""The race audit: static rules on PTX and SASS, compute-sanitizer runs, stress.

Public API:
  audit_ptx(ptx_text, roles, sass_text=..., param_names=...) -> AuditReport   (audit.py)
  audit_kernel(name, mutant=None, ...) -> AuditReport    (artifacts.py: builds, then audits)
  RULES (rules.py), run_tool / parse_tool_output (dynamic.py)
Nothing here imports the DSL at import time.
"""

from .audit import AuditInputError, AuditReport, Finding, audit_ptx
from .rules import RULES

__all__ = ["AuditInputError", "AuditReport", "Finding", "RULES", "audit_ptx"]
