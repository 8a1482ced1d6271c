"""gmtool plan: which capture sizes to pick for a workload (workload.py, costs.py, optimizer.py, engines.py,
document.py; run.py ties them together)."""
