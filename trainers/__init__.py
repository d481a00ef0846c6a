"""Training backends (installed as miles_agent.trainers)."""
