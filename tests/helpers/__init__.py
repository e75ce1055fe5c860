"""What the tests share, defined once (tests/conftest.py puts tests/ on sys.path; import as `helpers.X`):

    program     the installed inv run as a user runs it, run directories, one-line errors
    project     a throwaway Invoke project for the runner's tests
    processes   processes started, signalled and waited for as a terminal or a scheduler does
    interrupts  inv stopped by a signal, and what every stopped task must leave
    training    the settings of small, quick training runs and the losses they log
    corpus      corpora, datasets and loaders for the data tests
    files       what a folder holds; a real full disk (tmpfs)
    hostile     input made to stall Anvil (YAML alias bombs)
    comm        a made-up transport for preflight.comm
    kernels     tolerances, devices and poisoned memory for the Triton kernel tests
    cluster     SSH hosts and a Slurm cluster in network namespaces (also a script: `up`, `down`)
    browser     a real headless Chromium for the HTML reports (also a script: `shot`, `time`)

tests/house/test_house.py checks that no test module defines a name of these again.
"""
