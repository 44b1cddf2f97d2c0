"""`kvserve route`: a load balancer across OpenAI-compatible replicas (policies.py, app.py)."""
