from flaloop.cli import main

main()
