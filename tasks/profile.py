"""inv profile.*: placeholder, filled in by its issue."""
from invoke import Collection

ns = Collection("profile")
