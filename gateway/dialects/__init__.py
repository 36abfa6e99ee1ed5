"""The gateway's side of the agentic dialects: token ids through the engines' template, the session
each request names, and where stored responses live."""
