"""output"""

__all__: list[str] = []
