from plan3d.cli import main

main()
