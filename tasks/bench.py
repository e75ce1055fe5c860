"""inv bench.*: placeholder, filled in by its issue."""
from invoke import Collection

ns = Collection("bench")
