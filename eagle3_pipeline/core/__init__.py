"""Errors, output folders, stage configs and flags: what every stage shares."""
