"""The HTTP routes, one module per concern, each an APIRouter that the app factory (serve/app.py) includes."""
