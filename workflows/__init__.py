"""Workflows: orchestration that uses both capture and analyze (the matrix run, explain, the demo)."""
