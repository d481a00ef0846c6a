"""Example agent programs for the black-box harness (they only speak the OpenAI API and HTTP)."""
