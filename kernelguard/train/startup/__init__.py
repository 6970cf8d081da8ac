"""startup"""

__all__: list[str] = []
