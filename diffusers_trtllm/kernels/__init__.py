"""Kernel routes: each module wraps one implementation behind the ``Route`` interface."""
