"""Benchmarks: scripts that launch their own ranks, print a table and write results/<name>.json."""
