"""How work runs: the inv program, what tasks call, preflight checks, run directories, settings, where work
runs (cluster/: the Runtime value and every transport) and what every transport launches (launch/)."""
