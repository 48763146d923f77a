"""The OpenAI-compatible service: request and response shapes (protocol.py), the app (server.py), its metrics, a
client and a load generator."""
