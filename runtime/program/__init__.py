"""The `inv` program: Invoke with Fabric's host flags, task discovery, the .pth shim."""
