"""model"""

__all__: list[str] = []
