from sim.cli import main

main()
