"""Helpers every subsystem may use and that use nothing of rotarium: the standard library only."""
