"""The FastAPI routers: fine-tuning jobs and plans, files, models and deployments, the workers' internal reports,
and the dependencies they share. Thin: each validates, calls the store or submission/ and renders a view."""
