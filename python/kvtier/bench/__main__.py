import sys

print("usage: python -m kvtier.bench.ttft --help", file=sys.stderr)
sys.exit(2)
