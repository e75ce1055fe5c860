"""The `inv` program: Invoke with Fabric's -H fan-out, its settings file, the .pth shim."""
