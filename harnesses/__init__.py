"""Agent loops (installed as miles_agent.harnesses)."""
